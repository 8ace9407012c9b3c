"""``python -m ucm_client.admin``: the same as the ``ucm-admin`` console script."""

from ucm_client.admin.cli import main

raise SystemExit(main())
