"""Reading Prometheus metrics: a /metrics answer parsed into its samples, and
the alerting and recording rules the deploy recipes (``deploy/prometheus.yml``)
load."""

from __future__ import annotations

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"


class Scrape:
    """One answer of a /metrics endpoint: its samples and the names in it."""

    def __init__(self, text: str) -> None:
        self.samples: list[tuple[str, dict, float]] = []
        self.names: set[str] = set()
        for family in text_string_to_metric_families(text):
            self.names.add(family.name)
            for sample in family.samples:
                self.names.add(sample.name)
                self.samples.append((sample.name, dict(sample.labels), sample.value))

    def value(self, name: str, **labels) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(v for n, ls, v in self.samples if n == name and all(ls.get(k) == w for k, w in labels.items()))

    def has(self, name: str, **labels) -> bool:
        return any(n == name and all(ls.get(k) == w for k, w in labels.items()) for n, ls, _ in self.samples)


def deploy_rules() -> list[dict]:
    """Every rule of the rule files ``deploy/prometheus.yml`` names (each group named and not empty)."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    rules = []
    for name in config["rule_files"]:
        groups = yaml.safe_load((DEPLOY / name).read_text())["groups"]
        for group in groups:
            assert group["name"] and group["rules"], group
            rules.extend(group["rules"])
    return rules
