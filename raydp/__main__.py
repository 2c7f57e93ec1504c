from raydp.cli import main

raise SystemExit(main())
