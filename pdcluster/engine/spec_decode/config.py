"""`SpeculativeConfig`: which proposer a decode engine uses and how many tokens it proposes.

Parsed from the command-line form `METHOD[:ARG][,key=value...]`:
    ngram:k=4                   prompt lookup, up to 4 tokens, n-grams of 3 down to 1 tokens
    ngram:k=5,min_n=2,max_n=4   the same with other n-gram sizes
    draft:/models/small,k=4     a smaller model with the same tokenizer, 4 tokens per step
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")
_MAX_K = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft"
    num_speculative_tokens: int = 4  # k: the most tokens proposed per request per step
    draft_model: str | None = None  # the draft model's folder (method "draft")
    ngram_min: int = 1  # n-gram sizes tried, longest first
    ngram_max: int = 3

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got "
                             f"{self.method!r}")
        if not 1 <= self.num_speculative_tokens <= _MAX_K:
            raise ValueError(f"speculative k must be in [1, {_MAX_K}], got "
                             f"{self.num_speculative_tokens}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model path is needed by, and only by, method 'draft' "
                             "(draft:PATH,k=4)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram min_n <= max_n, got {self.ngram_min}, "
                             f"{self.ngram_max}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """`ngram:k=4`, `draft:PATH,k=4`; ValueError naming what is wrong."""
        method, _, rest = text.strip().partition(":")
        parts = [p for p in rest.split(",") if p] if rest else []
        fields: dict = {"method": method}
        if method == "draft" and parts and "=" not in parts[0]:
            fields["draft_model"] = parts.pop(0)
        names = {"k": "num_speculative_tokens", "min_n": "ngram_min", "max_n": "ngram_max"}
        for part in parts:
            key, eq, value = part.partition("=")
            if not eq or key not in names:
                raise ValueError(f"bad speculative option {part!r} in {text!r}; expected "
                                 f"{', '.join(k + '=N' for k in names)}")
            try:
                fields[names[key]] = int(value)
            except ValueError:
                raise ValueError(f"speculative option {key} must be an integer, got "
                                 f"{value!r}") from None
        return cls(**fields)

    @classmethod
    def coerce(cls, value: SpeculativeConfig | str | None) -> SpeculativeConfig | None:
        """None, a config, or its text form (YAML and node options carry the text)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls.parse(value) if value.strip() else None
        raise ValueError(f"speculative must be a string like 'ngram:k=4', got {value!r}")
