"""A small Kustomize renderer: the part of `kubectl kustomize` that deploy/k8s/ uses, so the
manifests can be built and checked where no kubectl is installed.

Supports a kustomization's `resources` (files and folders holding a kustomization.yaml),
`patches` given by `path` (strategic merge: maps merged key by key, lists of maps with a `name`
merged item by item on it, every other list replaced), and `images` (name → newName/newTag).
Anything else in a kustomization is refused with its key named, so an overlay never uses a
feature that this renderer would silently skip.

Must never: reach the network, or guess at a feature it does not implement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
CONTAINER_LISTS = ("initContainers", "containers")


class UnsupportedKustomization(ValueError):
    pass


def build(folder: Path) -> list[dict[str, Any]]:
    """Every object the kustomization in `folder` renders, in order."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise UnsupportedKustomization(f"{folder}/kustomization.yaml: {sorted(unknown)} not supported here")
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        objects.extend(build(path) if path.is_dir() else load(path))
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise UnsupportedKustomization(f"{folder}: a patch is a `path` only here, got {sorted(patch)}")
        for doc in load(folder / patch["path"]):
            merge(find(objects, doc["kind"], doc["metadata"]["name"]), doc)
    for image in kustomization.get("images", []):
        set_image(objects, image)
    return objects


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(matches) != 1:
        raise UnsupportedKustomization(f"a patch targets {kind}/{name}: {len(matches)} objects match")
    return matches[0]


def merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        current = target.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            merge(current, value)
        elif _named_maps(value) and _named_maps(current):
            _merge_named(current, value)
        else:
            target[key] = value


def _named_maps(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) and "name" in v for v in value)


def _merge_named(current: list[dict[str, Any]], patch: list[dict[str, Any]]) -> None:
    by_name = {item["name"]: item for item in current}
    for item in patch:
        if item["name"] in by_name:
            merge(by_name[item["name"]], item)
        else:
            current.append(item)


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """A workload's containers, init containers first; none for other kinds."""
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [c for key in CONTAINER_LISTS for c in pod.get(key, [])]


def set_image(objects: list[dict[str, Any]], image: dict[str, str]) -> None:
    name = image["name"]
    for obj in objects:
        for container in containers(obj):
            repo, _, tag = container["image"].partition(":")
            if repo == name:
                new_tag = image.get("newTag", tag)
                container["image"] = image.get("newName", repo) + (f":{new_tag}" if new_tag else "")
