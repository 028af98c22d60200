"""Accuracy metric module for `evaluate.load(<path to this file>)` (shipped in the repo: no Hub fetch at run time).

accuracy = (number of predictions equal to the reference) / (number of predictions)
"""

import datasets
import evaluate

_DESCRIPTION = "Accuracy: the fraction of predictions equal to their reference label."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    normalize (`bool`, defaults to `True`): return the fraction; if `False`, the count of correct predictions.
    sample_weight (`list` of `float`, *optional*): per-sample weights.
Returns:
    accuracy (`float` or `int`).
Example:
    >>> metric = evaluate.load("examples/metrics/accuracy/accuracy.py")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""
_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        return {"accuracy": accuracy(predictions, references, normalize, sample_weight)}


def accuracy(predictions, references, normalize=True, sample_weight=None):
    """The computation itself."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references.")
    weights = [1.0] * len(predictions) if sample_weight is None else [float(w) for w in sample_weight]
    correct = sum(w for p, r, w in zip(predictions, references, weights) if int(p) == int(r))
    if not normalize:
        return correct
    total = sum(weights)
    return float(correct / total) if total else 0.0
