"""`python -m tpuserve.cli COMMAND ...`, the same as the `tpuserve` console script."""

import sys

from tpuserve.cli.main import main

sys.exit(main())
