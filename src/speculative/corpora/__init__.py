"""Corpora of a target's own answers for corpus-lookup drafting: storage, the shipped
corpus of the default model, and building one from transcripts."""
