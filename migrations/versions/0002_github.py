"""github: pull-request events and commit-status postings (harness/github/models.py)

Revision ID: 0002_github
Revises: 0001
Create Date: 2026-12-02 12:32:28.808235
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_github"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "github_pull_request_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("delivery_id", sa.Integer(), nullable=False),
        sa.Column("repo", sa.String(length=200), nullable=False),
        sa.Column("pr_number", sa.Integer(), nullable=False),
        sa.Column("action", sa.String(length=30), nullable=False),
        sa.Column("head_sha", sa.String(length=40), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["delivery_id"],
            ["webhook_deliveries.id"],
            name=op.f("fk_github_pull_request_events_delivery_id_webhook_deliveries"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_github_pull_request_events")),
        sa.UniqueConstraint("delivery_id", name=op.f("uq_github_pull_request_events_delivery_id")),
    )
    op.create_index(
        op.f("ix_github_pull_request_events_repo"), "github_pull_request_events", ["repo"]
    )
    op.create_table(
        "github_status_postings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("submission_id", sa.Integer(), nullable=True),
        sa.Column("repo", sa.String(length=200), nullable=False),
        sa.Column("sha", sa.String(length=40), nullable=False),
        sa.Column("context", sa.String(length=100), nullable=False),
        sa.Column("state", sa.String(length=10), nullable=False),
        sa.Column("description", sa.String(length=140), nullable=False),
        sa.Column("target_url", sa.String(length=500), nullable=True),
        sa.Column("check_conclusion", sa.String(length=20), nullable=True),
        sa.Column("check_summary", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("posted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["submission_id"],
            ["submissions.id"],
            name=op.f("fk_github_status_postings_submission_id_submissions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_github_status_postings")),
    )
    op.create_index(op.f("ix_github_status_postings_sha"), "github_status_postings", ["sha"])
    op.create_index(
        op.f("ix_github_status_postings_submission_id"),
        "github_status_postings",
        ["submission_id"],
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_github_status_postings_submission_id"), table_name="github_status_postings"
    )
    op.drop_index(op.f("ix_github_status_postings_sha"), table_name="github_status_postings")
    op.drop_table("github_status_postings")
    op.drop_index(
        op.f("ix_github_pull_request_events_repo"), table_name="github_pull_request_events"
    )
    op.drop_table("github_pull_request_events")
