import sys

from manylora.openai.cli import main

sys.exit(main())
