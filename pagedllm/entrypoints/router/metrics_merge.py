"""The replicas' Prometheus texts as one exposition, each sample labelled with its replica.

Families of the same name from different replicas become one family (one
HELP and TYPE line), as a Prometheus server scraping the router expects.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample_line(sample: Sample) -> str:
    labels = ",".join(f'{name}="{_label_value(str(value))}"' for name, value in sample.labels.items())
    return f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}" if labels \
        else f"{sample.name} {floatToGoString(sample.value)}"


def merge_expositions(texts: dict[str, str], label: str = "replica") -> str:
    """``texts``: replica name -> its /metrics text. A text that does not parse is skipped."""
    families: dict[str, tuple[str, str, list[Sample]]] = {}
    for replica, text in texts.items():
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for family in parsed:
            _, _, samples = families.setdefault(family.name, (family.type, family.documentation, []))
            samples.extend(sample._replace(labels={label: replica, **sample.labels}) for sample in family.samples)
    lines: list[str] = []
    for name, (kind, documentation, samples) in families.items():
        lines.append(f"# HELP {name} {documentation.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(_sample_line(sample) for sample in samples)
    return "\n".join(lines) + "\n" if lines else ""
