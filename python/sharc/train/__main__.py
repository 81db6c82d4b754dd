"""`python -m sharc.train [args]`: see trainer.py (`--help`)."""

from sharc.train.trainer import main

if __name__ == "__main__":
    main()
