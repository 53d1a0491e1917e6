from collectives_server.cli.main import main

# Guarded: a process forked from the preloaded worker interpreter (preloaded_workers)
# imports this module as its parent's main module and must not run it.
if __name__ == "__main__":
    raise SystemExit(main())
