"""Evidence rendered for people: Markdown now; HTML and plots with the dashboard."""
