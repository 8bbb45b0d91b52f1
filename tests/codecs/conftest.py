import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # kv_strategies, shared by this directory's tests
