"""Renders the kustomize base and every overlay and validates each resource against the
Kubernetes OpenAPI schemas (kubernetes-validate), offline.

The renderer covers what these manifests use: `resources` (files and directories),
`components` (their resources and patches), `namespace`, `labels`, and strategic-merge `patches`
(maps merge, `null` deletes a key, lists of named items merge by name, other lists are replaced).
A kind Kubernetes does not define (the Prometheus operator's ServiceMonitor) is checked against
its schema in schemas/ (jsonschema).

usage: validate.py [K8S_DIR]        exits non-zero and names the file and field on any error
"""

import copy
import pathlib
import sys

import json

import jsonschema
import kubernetes_validate
import yaml

CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding"}


def merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        if all(isinstance(x, dict) and "name" in x for x in base + patch):
            out = [copy.deepcopy(x) for x in base]
            for item in patch:
                match = next((i for i, x in enumerate(out) if x["name"] == item["name"]), None)
                if match is None:
                    out.append(copy.deepcopy(item))
                else:
                    out[match] = merge(out[match], item)
            return out
    return copy.deepcopy(patch)


def apply_patches(docs, directory: pathlib.Path, kustomization):
    for patch in kustomization.get("patches", []):
        path = directory / patch["path"]
        p = yaml.safe_load(path.read_text())
        targets = [
            i
            for i, (d, _) in enumerate(docs)
            if d["kind"] == p["kind"] and d["metadata"]["name"] == p["metadata"]["name"]
        ]
        if len(targets) != 1:
            raise SystemExit(f"{path}: patch matches {len(targets)} resources")
        i = targets[0]
        docs[i] = (merge(docs[i][0], p), docs[i][1])


def resources(directory: pathlib.Path, kustomization):
    docs = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            docs.extend(render(path))
        else:
            docs.extend((d, path) for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def render(directory: pathlib.Path):
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = resources(directory, kustomization)
    for component in kustomization.get("components", []):
        path = directory / component
        component_kustomization = yaml.safe_load((path / "kustomization.yaml").read_text())
        docs.extend(resources(path, component_kustomization))
        apply_patches(docs, path, component_kustomization)
    apply_patches(docs, directory, kustomization)
    for doc, _ in docs:
        if "namespace" in kustomization and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = kustomization["namespace"]
        for label in kustomization.get("labels", []):
            doc["metadata"].setdefault("labels", {}).update(label.get("pairs", {}))
    return docs


def custom_schemas(root: pathlib.Path):
    """Schemas of the kinds Kubernetes does not define, by kind."""
    return {"ServiceMonitor": json.loads((root / "schemas" / "servicemonitor.json").read_text())}


def check(doc, version, custom):
    """Raises a ValidationError (with `path` and `message`) where `doc` breaks its schema."""
    schema = custom.get(doc["kind"])
    if schema is None:
        kubernetes_validate.validate(doc, version, strict=True)
    else:
        jsonschema.validate(doc, schema)


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent)
    custom = custom_schemas(root)
    version = "1.30.0"
    targets = [root / "base"] + sorted(p for p in (root / "overlays").iterdir() if p.is_dir())
    failures, count = 0, 0
    for target in targets:
        for doc, source in render(target):
            count += 1
            try:
                check(doc, version, custom)
            except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
                failures += 1
                where = ".".join(str(p) for p in e.path)
                print(f"{target.name}: {source.name}: {doc['kind']}/{doc['metadata']['name']}: {where}: {e.message}")
        print(f"{target.name}: rendered and checked")
    print(f"{count} resources, {failures} invalid")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
