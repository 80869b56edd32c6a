"""GitHub integration: webhook verification, the pull-request flow, commit statuses and check runs.

A pull request that adds or changes `scopes/*.yaml` reaches `/v1/github/webhook`
(harness/api/github.py); the delivery is verified and stored (webhooks.py) and a task on the
"github" Celery queue (tasks.py) lists the changed manifests, submits them and posts pending
statuses (pull_requests.py). When a submission reaches a verdict, hooks.py enqueues the verdict
posting (statuses.py). Only the process serving the API consumes "github": GPU workers never hold
GitHub credentials. docs/github.md describes settings and policies.
"""
