import sys

from skipkey.cli import main

sys.exit(main())
