from deadweight.cli import main

raise SystemExit(main())
