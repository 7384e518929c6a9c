"""The CPU cell's rule reward (verl's ``custom_reward_function``)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1 when the answer's number is among the response's words, plus 0.01 a word (GRPO groups then vary)."""
    words = solution_str.split()
    return float(ground_truth in words) + 0.01 * len(words)
