"""`python -m toolkit.engines.stub_server`: run the stand-in SGLang server."""

import sys

from toolkit.engines.stub_server import main

sys.exit(main())
