"""`python -m benchmarks`: every side-by-side benchmark in one run; see run.py."""

from benchmarks.run import main

if __name__ == "__main__":
    main()
