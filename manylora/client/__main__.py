import sys

from manylora.client.cli import main

sys.exit(main())
