from kvpool.cli import main

raise SystemExit(main())
