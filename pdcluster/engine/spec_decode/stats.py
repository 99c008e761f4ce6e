"""`SpecDecodeStats`: how speculation is doing, as plain counters the node can export
(torch-free). Acceptance rate = accepted / proposed; position i's rate = how often the i-th
proposed token was accepted, of the times one was proposed there."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_verifications: int = 0  # request-steps that verified at least one proposed token
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # proposed tokens the target accepted
    num_emitted_tokens: int = 0  # tokens those verifications produced (accepted + 1 each)
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_proposed` tokens kept."""
        missing = num_proposed - len(self.proposed_per_position)
        if missing > 0:
            self.proposed_per_position += [0] * missing
            self.accepted_per_position += [0] * missing
        self.num_verifications += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for pos in range(num_proposed):
            self.proposed_per_position[pos] += 1
            self.accepted_per_position[pos] += pos < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def position_rates(self) -> list[float]:
        return [a / p if p else 0.0
                for a, p in zip(self.accepted_per_position, self.proposed_per_position,
                                strict=True)]

    def as_dict(self) -> dict[str, float]:
        """Flat counters (`spec_*`) for `LLMEngine.stats()` and metrics exporters."""
        out: dict[str, float] = {
            "spec_num_verifications": self.num_verifications,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_emitted_tokens": self.num_emitted_tokens,
            "spec_acceptance_rate": round(self.acceptance_rate, 4),
        }
        for pos, rate in enumerate(self.position_rates()):
            out[f"spec_acceptance_rate_pos{pos}"] = round(rate, 4)
        return out
