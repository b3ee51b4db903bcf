from rollout_manager.cli import main

raise SystemExit(main())
