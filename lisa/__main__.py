from lisa.cli import main

raise SystemExit(main())
