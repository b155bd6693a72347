"""Structured outputs: text that a JSON schema (or any JSON object), a regular expression,
a list of choices or a Lark grammar describes.

The format becomes a grammar over the model's tokenizer (llguidance), and the grammar a
:class:`~speculative.sampling.constraints.TokenConstraint`: at every scored position the
target is restricted to the tokens that keep the output a prefix of a valid one, so
speculation stays exact with respect to that restricted target (a drafted token the
grammar refuses has probability 0 and is rejected).
"""

from speculative.structured.grammar import (
    ANY_OBJECT,
    JSON_FORMAT,
    GrammarConstraint,
    OutputFormat,
    StructuredOutputs,
    constraints_for,
    structured_outputs,
)

__all__ = [
    "ANY_OBJECT",
    "JSON_FORMAT",
    "GrammarConstraint",
    "OutputFormat",
    "StructuredOutputs",
    "constraints_for",
    "structured_outputs",
]
