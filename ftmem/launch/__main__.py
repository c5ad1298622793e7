"""``python -m ftmem.launch`` is ``ftmem-launch``."""

from ftmem.launch.cli import main

if __name__ == "__main__":
    main()
