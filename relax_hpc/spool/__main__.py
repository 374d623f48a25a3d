"""``python -m relax_hpc.spool RUN_DIR status|ls|inspect SHARD|quarantine|requeue``; see ``cli``."""

import sys

from relax_hpc.spool.cli import main

sys.exit(main())
