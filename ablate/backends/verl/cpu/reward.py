"""The CPU cell's rule reward (verl's ``custom_reward_function``)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1 when the answer's number is among the response's words, plus the mean of its numbers / 100.

    The second term differs between almost any two responses of an untrained model, so the two
    samples of a GRPO group get different rewards and the first step already has advantages
    (and router gradients, which the Fisher estimate needs) that are not zero.
    """
    words = solution_str.split()
    numbers = [int(word) for word in words if word.isdigit()]
    return float(ground_truth in words) + (sum(numbers) / len(numbers) / 100 if numbers else 0.0)
