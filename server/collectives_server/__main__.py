from collectives_server.cli import main

raise SystemExit(main())
