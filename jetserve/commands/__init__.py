"""The ``jetserve`` subcommands, one module per command group.

Each module's ``register(sub)`` adds its subparser(s) with ``set_defaults(func=...)``;
``jetserve/cli.py`` parses and calls ``args.func(args)``.

- ``gateway``, ``worker``, ``agent``, ``sim``: the processes of a fleet;
- ``tenants``, ``keys``, ``limits``, ``ledger``, ``routes``: the admin API
  (``admin`` holds their shared options, ``admin_client`` the HTTP client);
- ``scale``: the KEDA arithmetic over live queue lag (``jetserve/scale.py``);
- ``up``: the whole fleet on loopback (``jetserve/fleet.py``);
- ``bench``, ``conformance``: the benchmark harness and the adapter report.
"""
