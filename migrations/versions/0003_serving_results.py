"""serving_results: serving-engine evidence attached to a submission (harness/store/models.py)

Revision ID: 0003_serving_results
Revises: 0002_github
Create Date: 2026-12-02 16:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_serving_results"
down_revision = "0002_github"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "serving_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("submission_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=30), nullable=False),
        sa.Column("source_name", sa.String(length=255), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("attached_by", sa.String(length=100), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["submission_id"],
            ["submissions.id"],
            name=op.f("fk_serving_results_submission_id_submissions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_serving_results")),
    )
    op.create_index(op.f("ix_serving_results_submission_id"), "serving_results", ["submission_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_serving_results_submission_id"), table_name="serving_results")
    op.drop_table("serving_results")
