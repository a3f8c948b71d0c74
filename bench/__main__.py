"""``python -m bench`` (or ``make bench``): the serving comparison, bench/serving/compare.py."""
from bench.serving.compare import main

if __name__ == "__main__":
    main()
