"""Acceptance statistics for speculative decoding (plain Python)."""
from __future__ import annotations


class SpecStats:
    """Engine-wide acceptance counters (exported by /metrics and /server_info)."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.verify_count = 0
        self.accepted_tokens = 0
        self.accept_length_hist = [0] * (num_steps + 2)  # index = accepted + 1 (bonus included)
        self.accepted_at_position = [0] * num_steps  # draft depth d accepted (d = 1..num_steps)

    def record(self, num_accepted: int) -> None:
        self.verify_count += 1
        self.accepted_tokens += num_accepted
        self.accept_length_hist[num_accepted + 1] += 1
        for d in range(num_accepted):
            self.accepted_at_position[d] += 1

    def as_dict(self) -> dict:
        mean = (self.accepted_tokens + self.verify_count) / self.verify_count if self.verify_count else None
        return {"spec_verify_count": self.verify_count, "spec_accepted_tokens": self.accepted_tokens,
                "spec_accept_length": mean, "spec_accept_length_hist": list(self.accept_length_hist),
                "spec_accepted_per_position": list(self.accepted_at_position)}
