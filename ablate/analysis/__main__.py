from ablate.analysis.cli import main

raise SystemExit(main())
