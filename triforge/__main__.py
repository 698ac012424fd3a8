import sys

from triforge.cli import main

sys.exit(main())
