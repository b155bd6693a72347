"""speculative: lossless speculative decoding.

Vocabulary used throughout the package (as in the specification):

- target p: the model whose samples we want; draft q: the cheaper proposer.
- *drafted* tokens: the gamma (γ) tokens a drafter proposes in one round.
- *accepted* tokens: drafted tokens kept by the test u < min(1, p(x)/q(x)).
- *recovered* token: at the first rejection, a token resampled from the residual
  normalize(max(0, p - q)); the round ends there.
- *bonus* token: when all γ drafted tokens are accepted, one more token sampled from the
  target's distribution after the last of them (the target pass already computed it).
- α: acceptance rate, Σ min(p, q) = 1 - TV(p, q); γ: draft length per round;
  c: cost of one draft step relative to one target decode step;
  τ: mean accepted length, emitted tokens per target call (bonus/recovered included).
"""

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not import transformers
    if name in ("Speculator", "generate", "GenerationOutput"):
        from speculative import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'speculative' has no attribute {name!r}")
