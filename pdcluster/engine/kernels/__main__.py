"""`python -m pdcluster.engine.kernels [--force]`: build the engine's native kernels."""

import sys

from pdcluster.engine.kernels import main

sys.exit(main())
