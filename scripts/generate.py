"""Write the files generated from the one OPTIONS table (core/options.py); tests fail when they differ.

    python scripts/generate.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondemand_prof.core.options import render_config_module, render_config_reference  # noqa: E402

GENERATED = {ROOT / "ondemand_prof" / "core" / "config.py": render_config_module,
             ROOT / "docs" / "_generated" / "options.md": render_config_reference}


def main() -> int:
    for path, render in GENERATED.items():
        text = render()
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
