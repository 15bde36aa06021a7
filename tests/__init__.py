"""kvpool's tests. Where a test lives says what it tests (``tests/test_layers.py`` checks the rule):

* ``tests/test_<module>.py`` tests ``kvpool/<module>.py``, what a worker imports (``test_client.py`` for
  ``kvpool/client.py``); ``tests/server/``, ``tests/workers/`` and ``tests/benchmarks/`` do the same for
  ``server/``, ``workers/`` and ``benchmarks/`` (``tests/server/books/test_pool.py`` for ``server/books/pool.py``), and
  ``tests/integrations/test_vllm_<module>.py`` for ``kvpool/integrations/vllm/<module>.py``. A module whose tests
  need more than one file adds what they are about: ``test_<module>_<aspect>.py`` (``test_pool_fences.py``).
* A suite that checks what several modules do together is named for what it checks and listed in
  ``tests/test_layers.py`` (``SUITES``), in the folder of the layer it drives: the pool as a whole through its API
  (``tests/server/test_attacks.py``, ``test_bad_input.py``, ...), the workers as processes (``tests/workers/
  test_flow.py``).
* ``tests/reliability/`` (crashes, restarts, the soak), ``tests/gpu/`` (needs a CUDA device) and ``tests/docker/``
  (the image and compose files) cut across the modules, by what they check.

Fixtures of every test are in ``tests/conftest.py``, those of the server's tests in ``tests/server/conftest.py``. A
test of what the pool answers takes a pool served in the test process (``pool_server``, ``local_pool``: milliseconds
to start); one of what only a process shows (a crash, a signal, a worker process, the HTTP listeners' guards) takes
``kvpool serve`` itself (``pool_process``, ``start_pool``).
"""
