"""A bare Hydra app whose job does nothing: the baseline of bench/bench_sweep_overhead.py."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=".", config_name="config")
def main(cfg: DictConfig) -> float:
    return 0.0


if __name__ == "__main__":
    main()
