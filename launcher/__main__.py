"""``python -m launcher`` is ``ftmem-launch``."""

from launcher.cli import main

if __name__ == "__main__":
    main()
