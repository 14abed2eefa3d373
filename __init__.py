"""The clone's folder, imported as `toolkit` when the folder that holds a clone named `toolkit` is
on Python's path: a script that sits beside the clone, or Python started there. The package is the
`toolkit` folder inside the clone: it is loaded here, in this module's place, so that `import
toolkit` gives the package wherever the script sits. Inside the clone, and from an installed
environment run elsewhere, this file is never imported.
"""

import importlib.util as _util
import os as _os
import sys as _sys

if __name__ == "toolkit":
    _inner = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "toolkit")
    _spec = _util.spec_from_file_location(
        "toolkit", _os.path.join(_inner, "__init__.py"), submodule_search_locations=[_inner]
    )
    _package = _util.module_from_spec(_spec)
    _sys.modules["toolkit"] = _package  # what `import toolkit` returns once this file has run
    _spec.loader.exec_module(_package)
