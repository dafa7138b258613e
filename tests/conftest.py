import sys
from pathlib import Path

# Test helpers (oracle.py) and the example backends import from here.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "broken_backend"))
