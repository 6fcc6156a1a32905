import sys

from caldrix.cli import main

sys.exit(main())
