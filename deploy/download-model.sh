#!/usr/bin/env bash
# A GPU node's copy of the model (deploy/cluster-aws.yaml's worker setup runs it): a Hugging Face
# repository downloaded into a directory, once. A gated model's token is read from AWS SSM
# Parameter Store with this node's IAM role and lives only in the download's environment: never
# in a file, on a command line or in the cluster config, and never on the head (whose launcher
# holds every file it copies to the nodes, file_mounts).
#
#   deploy/download-model.sh REPO DIR [SSM_PARAMETER]
#
# Without SSM_PARAMETER it downloads without a token (a public model). Needs the AWS CLI (on AWS's
# Deep Learning AMIs) where a parameter is named, and `hf` (make setup installs it in .venv).
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    echo "usage: $0 REPO DIR [SSM_PARAMETER]" >&2
    exit 2
fi
repo=$1
dir=$2
parameter=${3:-}
PATH="$PATH:$(cd "$(dirname "$0")/.." && pwd)/.venv/bin"

if [ -f "$dir/config.json" ]; then
    echo "$dir holds $repo already"
    exit 0
fi

# This node's region, from the instance metadata service (IMDSv2: a session token first).
region() {
    local imds=http://169.254.169.254/latest session
    session=$(curl -sSf -X PUT "$imds/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 60")
    curl -sSf -H "X-aws-ec2-metadata-token: $session" "$imds/meta-data/placement/region"
}

if [ -n "$parameter" ]; then
    HF_TOKEN=$(aws ssm get-parameter --region "$(region)" --name "$parameter" --with-decryption \
        --query Parameter.Value --output text)
    export HF_TOKEN
fi
sudo mkdir -p "$dir"
sudo chown "$USER" "$dir"
hf download "$repo" --local-dir "$dir" --exclude 'original/*'
echo "$repo downloaded to $dir"
