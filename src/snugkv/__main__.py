from snugkv.cli import main

raise SystemExit(main())
