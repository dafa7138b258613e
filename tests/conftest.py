import sys
from pathlib import Path

# The example backends import from here.
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "broken_backend"))
