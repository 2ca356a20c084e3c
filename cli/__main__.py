"""``python -m gcache.cli``: the ``gcache`` command."""

from gcache.cli import main

if __name__ == "__main__":
    main()
