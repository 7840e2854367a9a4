"""python -m onceflow.cli"""

import sys

from onceflow.cli import main

sys.exit(main())
