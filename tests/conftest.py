import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the graph checker runs after every compile stage and pass in tests (cube.config.check_graphs);
# set here, before anything compiles, so multi-rank workers inherit it
os.environ.setdefault("CUBE_CHECK_GRAPHS", "1")
