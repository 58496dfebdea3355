"""``policies.gallery`` is ``cube.policies.gallery`` (the policies ship inside cube); kept for old imports."""
import sys

from cube.policies import gallery as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})   # loaded by path
sys.modules[__name__] = _moved   # imported by name: the very module cube.policies.gallery
