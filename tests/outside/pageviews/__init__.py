"""A pipeline from outside onceflow's repository, as a user writes one: page views counted
per country and per page. Not installed: the tests reach it only by reference
(``pageviews.pipelines:PAGE_VIEWS``) with this folder on PYTHONPATH, as a user would."""
