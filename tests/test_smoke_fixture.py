from kvpool.client import PoolClient


def test_pool_server_fixture_serves_a_session(pool_server):
    with PoolClient(pool_server.url, name="t") as pool:
        assert pool.alloc(2) == [0, 1]
    assert pool_server.stats()["free"] == 64
