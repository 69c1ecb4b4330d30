import sys

from perfmodel.cli.main import main

sys.exit(main())
